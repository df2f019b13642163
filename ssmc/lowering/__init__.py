"""Lowering: from the IR to loop nests that backends print (strategies in plan.py)."""
