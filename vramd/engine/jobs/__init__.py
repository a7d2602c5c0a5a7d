"""The three jobs: dump (BOs -> image), restore (image -> BOs) and verify (image -> checked), one pipeline."""
from .common import Ahead, BoSpec, Job, JobContext, RestoreTarget
from .dump_job import DumpJob
from .restore import RestoreJob
from .verify import VerifyJob

__all__ = ["Ahead", "BoSpec", "DumpJob", "Job", "JobContext", "RestoreJob", "RestoreTarget", "VerifyJob"]
