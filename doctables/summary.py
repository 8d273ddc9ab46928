"""Renderers to come."""
