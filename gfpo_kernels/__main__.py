"""`python -m gfpo_kernels`: prints the environment report to paste into a bug report."""

from .env_report import environment_report

print(environment_report())
