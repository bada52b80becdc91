"""Built-in hardware profiles (JSON), shipped as package data."""
