"""The spec language: tensors that trace into IR, the step decorator, attention."""
