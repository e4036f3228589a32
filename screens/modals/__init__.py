"""Modal screens: confirm a step, end the VRAM holders, errors, quit while down, help, pick runs."""
