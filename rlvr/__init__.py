"""rlvr: policy-gradient RL for language models against rewards a program can check."""

__version__ = "0.1.0"
