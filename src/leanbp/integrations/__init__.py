"""Glue for the libraries that drive a model: TRL's trainers (``leanbp.integrations.trl``)."""
