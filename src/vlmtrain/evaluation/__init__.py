"""Evaluation by external harnesses: lmms-eval (lmms.py) runs its tasks on a vlmtrain checkpoint."""
