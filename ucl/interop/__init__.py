"""Interoperation with other frameworks' checkpoints and configs."""
