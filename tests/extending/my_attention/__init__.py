"""A user's own package, outside the suite (docs/extending.md, "A user's attention, without
editing the suite"): on the Python path, its class runs as attention=custom."""
