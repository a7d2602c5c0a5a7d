"""The three jobs: dump (BOs -> image), restore (image -> BOs) and verify (image -> checked), one pipeline."""
from .common import Ahead, BoItem, BoSpec, JobContext, RestoreTarget, check_gpu
from .dump_job import DumpJob
from .interface import BoIntake, Intake, Job
from .restore import RestoreJob
from .verify import VerifyJob

__all__ = ["Ahead", "BoIntake", "BoItem", "BoSpec", "DumpJob", "Intake", "Job", "JobContext", "RestoreJob",
           "RestoreTarget", "VerifyJob", "check_gpu"]
