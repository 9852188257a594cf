"""CPU builds: one torch C++ extension holding every op, plus one wrapper module per op."""
