"""End-to-end tests of the model explorer (GET /): its routes, and the page in headless Chromium."""
