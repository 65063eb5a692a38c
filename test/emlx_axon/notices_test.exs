defmodule EMLXAxon.NoticesTest do
  # Notices are logged only when a result's fallbacks point at them, and
  # only the ones the engine holds: none on a machine where every check
  # passed (or none ran), so nothing is logged there.
  use ExUnit.Case, async: false

  import ExUnit.CaptureLog

  alias EMLXAxon.Notices

  test "fallbacks that do not name the notices log nothing and ask the engine nothing" do
    assert capture_log(fn ->
             assert Notices.log_for(["cpu_layers: the CPU kernels do not take every layer"]) ==
                      :ok

             assert Notices.log_for(nil) == :ok
           end) == ""
  end

  test "the engine's notices are logged once each" do
    notices = EMLXAxon.mlx_info()[:notices]
    assert is_list(notices)

    first = capture_log(fn -> Notices.log_for(["x: failed its check (see the notices)"]) end)
    second = capture_log(fn -> Notices.log_new() end)

    for message <- notices do
      refute second =~ message
      assert first =~ message or :persistent_term.get({Notices, :seen}, 0) >= length(notices)
    end

    if notices == [], do: assert(first == "" and second == "")
  end
end
