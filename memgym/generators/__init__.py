"""Built-in sample generators: each module exposes ``make_source(split, seed, **kwargs)``."""
