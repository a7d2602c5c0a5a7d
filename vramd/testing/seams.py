"""vramd.testing.seams: the switches and injection points tests use instead of patching private names.

- `python_copier()`: while held, the batch copier and the byte-plane transform run their pure-Python paths
  even where the C module (vramd.hostmem._copy) is built, so a test runs both and compares them;
- `mincore_only()`: while held, the page-cache question a restore asks of each record goes to mincore(2),
  as on a kernel without cachestat(2);
- `intercept_copies(fn)`: while held, every batch of CPU copies in this process (a dump's reads of BOs, a
  restore's reads of records, probes of ranges) is `fn(copies, flags, run)`: watch it, hold it, or
  change its outcome to inject the fault a real device would give.

Each works in this process only (an in-process Engine), in every thread, and is undone on the way out.
"""
from ..hostmem.batchcopy import Interceptor, Run
from ..hostmem.batchcopy import intercepted as intercept_copies
from ..hostmem.libc import has_cachestat, mincore_only
from ..hostmem.native import python_only as python_copier

__all__ = ["Interceptor", "Run", "has_cachestat", "intercept_copies", "mincore_only", "python_copier"]
