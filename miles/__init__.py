"""miles: RL post-training for language models as a plain library (no Prefect in here)."""

import os

# Model loads print tqdm bars per actor; runs report progress themselves.
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
