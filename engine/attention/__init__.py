"""Attention backends behind one seam. The names live here, torch-free, so EngineArgs can check them."""

BACKEND_NAMES = ("auto", "torch", "cpu", "triton")
