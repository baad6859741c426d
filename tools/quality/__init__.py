"""Quality of quantized formats on a real model."""
