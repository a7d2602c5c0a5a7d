"""The workload child's entry point: `python -m vramd.testing.workload_child SPEC_JSON` (see workload.py)."""
from .workload import main

if __name__ == "__main__":
    main()
