"""The benchmark: prompts, runners, report."""
