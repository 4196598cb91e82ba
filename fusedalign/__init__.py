"""fusedalign: post-training whose output head never materialises the logits."""

__version__ = "0.1.0"
