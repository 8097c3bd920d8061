"""What a run is set up from, checked before any actor starts: the config (`config`, pydantic),
its errors (`errors`), the model shapes and their memory arithmetic (`presets`,
`preset_tables`), the user's hooks and their defaults (`hooks`), and the data (`dataset`).
"""
