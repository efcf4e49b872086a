"""Other frameworks' checkpoint formats, one package each, reader and writer side by side:
``dcp`` (PyTorch Distributed Checkpoint), ``deepspeed``, ``megatron`` (torch_dist and legacy),
``hf`` (Hugging Face safetensors) and ``torchzip`` (``torch.save`` archives, read without executing
them). ``registry`` detects a folder's format and opens it; ``base`` holds the shared records."""
