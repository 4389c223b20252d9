"""Named model profiles: published configs (no weights) and the shipped small model."""
