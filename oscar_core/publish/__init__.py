"""Bundles out to the world: the method authors' rotation files (upstream) and their served variant (served), model
cards (card), hub pushes (hub, hub_clients), the zoo of rebuilt bundles (zoo)."""
