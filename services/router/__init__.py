"""The router: one HTTP front for many folio replicas, sending each request where its prefix is cached."""
