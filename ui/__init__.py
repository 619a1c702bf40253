"""The pages a person opens in a browser: the demo and video pages (`ui.pages`, static
files under `ui/static/`) and the operator's dashboard (`ui.dashboard`). They are
mounted beside the wires and speak to the server only through its public APIs."""
