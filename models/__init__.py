"""Built-in model specs (YAML), shipped as package data."""
