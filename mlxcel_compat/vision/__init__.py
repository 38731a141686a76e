"""Vision-language models through mlx-vlm."""
