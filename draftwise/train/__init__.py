"""Training, apart from the inference path (which never imports it): a feature head for method "head".

Its training data (corpus.py: package sources and docs; answers.py and everyday.py: the target's own answers), the
target's features over them (features.py), training (head.py), the head scored as the engine runs it (as_run.py) and
the `draftwise train-head` command (command.py). The head's model and its files are proposers/head_model.py, and the
proposer that drafts with it proposers/feature_head.py: both are inference."""
