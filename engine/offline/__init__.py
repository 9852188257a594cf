"""A model without a server: the default checkpoint, the plain generation loop the serving engine must match, and
the `tideflow model init` / `tideflow generate` commands."""
