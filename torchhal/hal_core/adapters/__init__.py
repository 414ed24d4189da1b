"""Adapters built into the core distribution (only the CPU, which is always present)."""
