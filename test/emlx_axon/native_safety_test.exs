defmodule EMLXAxon.NativeSafetyTest do
  # What the NIF guarantees the VM: an MLX error never exits it, nothing that
  # touches MLX runs on a normal scheduler, and streams do not leak.
  use ExUnit.Case, async: false

  alias EMLXAxon.{Native, TestFixtures}

  @moduletag :reliability

  @root TestFixtures.root()

  # Runs `code` in a fresh `elixir` OS process with this project's code on
  # its path, so the NIF is loaded anew and nothing has called MLX yet.
  defp fresh_vm(code) do
    elixir = System.find_executable("elixir") || flunk("elixir is not on the PATH")
    ebin = Path.join(Mix.Project.build_path(), "lib/emlx_axon/ebin")
    System.cmd(elixir, ["-pa", ebin, "-e", code], stderr_to_stdout: true, cd: @root)
  end

  describe "MLX errors" do
    test "a failing MLX call as the first MLX call of a fresh VM returns an error" do
      # On a CPU-only libmlx, making a GPU stream fails inside MLX itself;
      # MLX-C's default error handler would print and exit the VM. On a CUDA
      # libmlx it succeeds, and the VM must still exit with its own status:
      # MLX synchronizes the stream at exit, which needs CUDA's runtime
      # still there (it was gone when the stream was MLX's first CUDA use).
      {output, status} =
        fresh_vm("""
        IO.puts("first call: " <> inspect(EMLXAxon.Native.stream_new(:gpu)))
        IO.puts("still alive")
        """)

      assert status == 0, "the VM exited with #{status}:\n#{output}"
      assert output =~ "still alive"

      if Native.mlx_info().gpu_available do
        assert output =~ "first call: {:ok, #Reference"
      else
        assert output =~
                 ~s(first call: {:error, {:invalid_argument, "no GPU device: this libmlx was built for CPU only"}})
      end
    end
  end

  describe "schedulers" do
    # NIFs that neither call MLX nor block: they only read Rust-side state.
    @plain ~w(model_info tokenizer_info stream_info stream_close generation_stats quantization_support)

    test "every NIF that touches MLX or can block runs on a dirty scheduler" do
      sources = Path.wildcard(Path.join(@root, "native/nif/src/*.rs"))
      assert sources != []

      nifs =
        for file <- sources,
            [_, attribute, name] <-
              Regex.scan(
                ~r/#\[rustler::nif(\([^)]*\))?\]\s*(?:pub\s+)?fn\s+(\w+)/,
                File.read!(file)
              ) do
          {name, attribute =~ ~r/schedule = "Dirty(Cpu|Io)"/}
        end

      assert length(nifs) >= 20
      undirty = for {name, false} <- nifs, name not in @plain, do: name
      assert undirty == [], "NIFs on a normal scheduler: #{Enum.join(undirty, ", ")}"

      # Each plain NIF still exists (a rename must be reviewed here).
      names = Enum.map(nifs, &elem(&1, 0))
      assert @plain -- names == []
    end
  end

  describe "streams" do
    @describetag :fixtures

    defp threads, do: length(File.ls!("/proc/self/task"))

    # Makes `count` CPU streams, all alive at once, runs a one-token
    # generation on each (a CPU stream's thread starts on first use), then
    # lets them be collected.
    defp use_streams(count, state, ids) do
      task =
        Task.async(fn ->
          streams =
            for _ <- 1..count do
              {:ok, stream} = Native.stream_new(:cpu)
              opts = TestFixtures.native_opts(%{max_new_tokens: 1})
              {:ok, gen} = Native.generation_start(state.ref, nil, stream, [ids], opts)
              {:ok, {:done, _}} = Native.generation_next(gen, 1)
              stream
            end

          length(streams)
        end)

      assert Task.await(task, 120_000) == count
      # The task's heap held the only references: collect them everywhere.
      for pid <- Process.list(), do: :erlang.garbage_collect(pid)
      Process.sleep(100)
    end

    unless File.dir?("/proc/self/task"), do: @tag(skip: "counts threads in Linux's /proc")

    test "collected streams give their MLX stream and thread back; the pool is bounded" do
      state = TestFixtures.model("qwen3-4bit-g64")
      ids = Enum.to_list(100..107)
      use_streams(2, state, ids)
      baseline = threads()

      use_streams(60, state, ids)
      first = threads()
      use_streams(60, state, ids)
      second = threads()

      # At most 32 CPU streams (one thread each) ever exist, and a second
      # round reuses the first round's.
      assert first - baseline <= 32, "60 streams added #{first - baseline} threads"

      assert second <= first + 2,
             "a second round of 60 streams grew #{first} -> #{second} threads"
    end
  end
end
