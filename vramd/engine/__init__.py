"""The transfer engine: one pipeline for dump, restore and verify, over the backends and the image format.

    from vramd.engine import Engine, EngineConfig, BoSpec, RestoreTarget
"""
from .engine import DEFAULT_CHUNK_SIZE, Engine, EngineConfig
from .jobs import Ahead, BoSpec, DumpJob, Job, RestoreJob, RestoreTarget, VerifyJob
from .pipeline import Progress

__all__ = ["DEFAULT_CHUNK_SIZE", "Ahead", "BoSpec", "DumpJob", "Engine", "EngineConfig", "Job", "Progress",
           "RestoreJob", "RestoreTarget", "VerifyJob"]
