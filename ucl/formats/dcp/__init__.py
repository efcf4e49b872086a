"""PyTorch Distributed Checkpoint folders: ``metadata`` (the ``.metadata`` file, read without executing
it), ``read`` (a folder described for reading in place)."""
