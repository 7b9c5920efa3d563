"""`python -m gfpo_kernels`: prints the kernel package's environment report to paste into a bug report."""

from .env_report import environment_report

print(environment_report())
print("trainer: python -m gfpo_trainer env adds whether TRL is supported and the vLLM it generates with")
