"""``torch.save`` zip archives: ``read`` (an allow-list unpickler; tensors stay on disk) and ``write``
(the inverse, for exports)."""
