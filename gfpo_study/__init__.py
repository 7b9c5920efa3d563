"""The length study: does GFPO shorten a model's answers at GRPO's accuracy? Arms x seeds from the same start, on
held-out prompts, with intervals over seeds (study.py, study_stats.py, study_report.py), and its example task, sums
of small numbers with a tiny model (sums_task.py, demo.py). The trainer (gfpo_trainer) imports nothing of it."""
