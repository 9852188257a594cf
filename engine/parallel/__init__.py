"""Expert parallelism: process groups, token dispatch/combine, DEP ranks and expert load statistics."""
