"""The browser pages (playground, dashboard) and the time series they read."""
