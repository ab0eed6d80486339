"""The whole jobs: `make quickstart` against the plain `Trainer`, the callbacks' cost, tokenization memory and CI's
wall time (their scripts' docs fragments)."""
