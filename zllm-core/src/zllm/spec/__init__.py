"""Pure-data contracts: config, TensorSpec, ModelCard, request schema, errors. Imports nothing above it."""
