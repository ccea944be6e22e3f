"""(to be written: see eins/ops/linalg.py for the pattern)"""
__all__ = []
