"""A trained feature head for method "head": the model (model.py), its training data (corpus.py: package sources
and docs; answers.py: the target's own answers), the target's features over them (features.py), training
(train.py) and the `draftwise train-head` command (command.py). The proposer is proposers/feature_head.py."""
