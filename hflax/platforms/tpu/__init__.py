"""TPUs: the plain XLA path (platforms/xla.py) plus the splash attention kernel
(attention.py) for long teacher-forced passes."""
