"""The API's routes, one router per resource; `taskloom.api.app.create_app` includes them."""
