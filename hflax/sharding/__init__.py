"""Meshes, resource pools, parameter layouts, the hybrid engine and the auto-mapper."""
