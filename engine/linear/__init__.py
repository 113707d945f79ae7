"""Linear layers: one interface (base.py), one implementation per weight format and kernel, and the
table that picks one for each layer at load (choose.py)."""
