"""The benchmark (prompts, runners, report) and the load generator, which drives a live server over HTTP."""
