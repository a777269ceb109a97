"""Stage runtimes: what runs each kind of stage while a pipeline runs (see the README)."""
