"""The structured-generation DSL (imported as ``radixserve.frontend``)."""
