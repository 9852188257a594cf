"""KVCache tiers below a member's device pool: host memory (G2), a local disk (G3) and a store shared by the fleet
(G4); the checksummed, version-salted block records kept there; and the expiry that bounds them."""
