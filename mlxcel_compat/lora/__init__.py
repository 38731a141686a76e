"""LoRA adapter files and the unfused layers that apply them."""
