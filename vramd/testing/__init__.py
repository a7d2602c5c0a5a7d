"""Test support that ships with vramd, like trio.testing: for vramd's own tests, benchmarks, and anyone
building on vramd.

- `DaemonProcess`: a real daemon as a child process (ready on sd_notify, its log watchable);
- `Workload`: a child process holding memory with known contents (regions, digests);
- `FakeDmaBackend`: an asynchronous backend with an engine thread, injectable faults and delays;
- `check_backend`: the contract every backend passes, with subjects for procmem, mmap, sdma (on the
  software model) and the fake;
- `RunAs`, `PythonAccess`: run those children as another user, with an interpreter that user can reach;
- `transcript`, `transcript_drive`, `transcript_record`, `transcript_scenarios` (imported by name): the
  client-session transcripts that keep the Python client and libvramd in step (tests/transcripts/README.md).
"""
from .contract import SUBJECTS, Subject, check_backend, seal_size
from .fake import FakeDmaBackend
from .launcher import DaemonProcess
from .runas import PythonAccess, RunAs
from .workload import Workload, blank_spec_like

__all__ = ["SUBJECTS", "DaemonProcess", "FakeDmaBackend", "PythonAccess", "RunAs", "Subject", "Workload",
           "blank_spec_like", "check_backend", "seal_size"]
