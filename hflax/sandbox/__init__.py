"""User code in worker processes: whatever it does (os._exit, a segfault, a hang, a
signal, unbounded memory) ends a worker, never the process that called it. Imports no
JAX, so a worker starts in a fraction of a second."""
from hflax.sandbox.pool import Outcome, ProcessPool, report_progress

__all__ = ["Outcome", "ProcessPool", "report_progress"]
